! Fortran names (tests/test_symbolize_debuginfo.py): a module procedure (`__physics_MOD_compute`)
! and the main program (`MAIN__`, named `sym_prog` in DWARF).
module physics
  implicit none
contains
  subroutine compute(n, r)
    integer, intent(in) :: n
    real(8), intent(out) :: r
    integer :: i
    r = 0
    do i = 1, n
      r = r + sqrt(real(i, 8))
    end do
  end subroutine
end module

program sym_prog
  use physics
  implicit none
  real(8) :: r
  call compute(1000, r)
  print *, r
end program
